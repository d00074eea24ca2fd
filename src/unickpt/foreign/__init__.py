"""Checkpoints of other formats as sources and targets of unickpt's online load and save.

``unickpt.load`` reads a Hugging Face safetensors model (``model.safetensors`` or a sharded
``model.safetensors.index.json``) and a ``torch.distributed.checkpoint`` folder in place of a
unickpt checkpoint: their headers are translated into unickpt metadata
(:mod:`.safetensors_read`, :mod:`.dcp_read`) and the usual planner reads, on each rank, the
bytes of what it holds; float8 weights stored in blocks with scales (DeepSeek-V3) load
dequantized with ``dequantize=True`` (:mod:`.fp8_blocks`, :mod:`.dequantizing`).
``unickpt.save(..., format="safetensors")`` writes Hugging Face's sharded layout from every
rank at once (:mod:`.safetensors_write`). See docs/formats.md.
"""
