"""One job end to end inside the worker: tokenize and render chats, run through the engine, build
the training record, write the file; ``JobError`` maps every failure to an ``ErrorType``.
"""
