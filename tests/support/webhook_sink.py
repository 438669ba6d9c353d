"""A result sink that posts each result to a webhook: the whole cost of delivering results
somewhere new (``layertap.worker.queue.sinks``), this one file. Wired by settings, nothing else:

    LAYERTAP_WORKER__RESULT_SINKS='{"metrics": {}, "tests.support.webhook_sink:WebhookSink": {"url": "http://..."}}'

Each result is one ``POST`` of its JSON (``Content-Type: application/json``), after its publish
committed; a refused or failed post raises, which the publisher logs (the result stays published).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence

from layertap.protocol.schema import Result
from layertap.worker.queue.sinks import ResultSink, SinkContext


class WebhookSink(ResultSink):
    def __init__(self, context: SinkContext, url: str, timeout_s: float = 10.0):
        self.url, self.timeout_s, self.node = url, timeout_s, context.node

    def after_publish(self, results: Sequence[Result]) -> None:
        for result in results:
            request = urllib.request.Request(self.url, data=result.model_dump_json().encode(), method="POST",
                                             headers={"Content-Type": "application/json", "X-Layertap-Node": self.node})
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
