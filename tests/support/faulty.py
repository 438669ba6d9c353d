"""A tiny model whose batched path is wrong by a real fault of its own code (loaded with
``trust_remote_code``), which the load-time self-check does not reach: in a forward of more than
:data:`WRAP_AT` tokens in a row, its decoder layer 1 reads the states of the positions past
:data:`WRAP_AT` from :data:`WRAP_AT` positions earlier, as a kernel that wraps around its block
would. One prompt alone (at most :data:`WRAP_AT` tokens) and the self-check's probes (8 of 3-64
tokens, 175 in all, in one packed row) are computed right; rows packed past the point are not."""

from __future__ import annotations

WRAP_AT = 192

FAULTY_BATCH_MODEL_CODE = f'''
"""A Qwen3 model whose decoder layer 1 wraps positions past {WRAP_AT} of a long forward around."""
from transformers import Qwen3ForCausalLM

WRAP_AT = {WRAP_AT}


def _wrap_around(module, args, kwargs):
    hidden = args[0] if args else kwargs["hidden_states"]
    if hidden.shape[1] <= WRAP_AT:
        return None
    wrapped = hidden.clone()
    wrapped[:, WRAP_AT:] = hidden[:, : hidden.shape[1] - WRAP_AT]
    if args:
        return (wrapped, *args[1:]), kwargs
    return args, {{**kwargs, "hidden_states": wrapped}}


class WrappingQwen3ForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model.layers[1].register_forward_pre_hook(_wrap_around, with_kwargs=True)
'''
