"""The vision side of a vision-language model, one job per module: ``processors`` (its processor,
loaded with ``AutoProcessor``), ``inputs`` (which families batch image chats, the merging of their
processor outputs, M-RoPE positions numbered on the host), ``towers`` (a batch's grid tower run
one image at a time), ``tower_graphs`` (that one-image forward replayed as CUDA graphs),
``attention`` (one varlen flash call per layer for towers that cut patches by ``cu_seqlens``) and
``aligned_mlp`` (tower MLPs widened with zero channels to an aligned width). ``loading`` finds and
sets them up once, at load; the engine's runner applies them around image forwards.
"""
