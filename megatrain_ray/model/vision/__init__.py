"""Vision-language models: the vision tower and multimodal projector of a LLaVA or Gemma 3 multimodal checkpoint as
transformers' own modules on the GPU worker (modules.py), their training state (tier.py), where their features go
(splice.py), the checkpoint's names (names.py) and the export (export.py). The language model streams on its native
template (engine/vision_engine.py wires the two). docs/vision.md."""
