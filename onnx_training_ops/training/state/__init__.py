"""The state and what is derived from it: :mod:`.state` (state variables found in
``training_info``, assigned with checks, initialized), :mod:`.nominal` (checkpoints without
values), :mod:`.flat_parameters` (the parameters as one vector), :mod:`.shard` (ZeRO-1's
per-rank model), :mod:`.fingerprint` (what data-parallel ranks must share) and
:mod:`.torch_names` (the weights under torch's names).
"""
