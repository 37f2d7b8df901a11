"""vLLM's ``current_stream`` as the skinny GEMM's compile uses it: the stream set last, else torch's current one."""

import threading

import torch

_current_stream_tls = threading.local()


def current_stream() -> torch.cuda.Stream:
    stream = getattr(_current_stream_tls, "value", None)
    return stream if stream is not None else torch.cuda.current_stream()
