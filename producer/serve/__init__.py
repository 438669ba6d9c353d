"""``layertap serve``: the HTTP front of ``vllm serve`` with hidden-state extraction, answered by
layertap's workers, so clients written for it (speculators' ``prepare-data``,
``generate-offline-data`` and ``train --on-missing generate``) run against layertap unchanged.

Routes, with vLLM's paths, fields and error body (``{"error": {"message", "type", "param", "code"}}``):

* ``GET /v1/models``: the one model this front serves;
* ``POST /v1/completions``: one prompt (token ids or text) is one job;
* ``POST /v1/chat/completions``: one chat is one job (the worker renders it with its template);
* ``POST /v1/chat/completions/render``: a chat's token ids from the model's tokenizer and chat
  template, loaded here (no model, no job);
* ``GET /health``: 200 while a live worker serves the model, else 503.

Invariants:

* a request is one job with an id of its own (``cmpl-<hex>``, ``chatcmpl-<hex>``, also the
  answer's ``id``): its file is its alone, so a client may move or delete it (speculators does);
* the answer's ``kv_transfer_params["hidden_states_path"]`` is the path of the job's ok result,
  and ``prompt_token_ids`` (``return_token_ids``) the ``token_ids`` of that file; no path is ever
  taken from a request;
* a job's error result is an HTTP error naming the job and its error type, never an empty
  answer; a request layertap cannot answer as asked (generating tokens, streaming, options the
  jobs lack) is refused with a 400 saying what and why;
* nothing is generated: the answer's completion is empty (``finish_reason`` ``"length"``).
"""
