"""One job inside the worker: tokenize and render chats, run it through the engine, write its
file, build its result; every failure becomes an ``ErrorType`` here.
"""
