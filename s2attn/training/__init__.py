"""The HHST language model: presets and configs (``presets``), offline byte-level data (``data``),
training (``train``) and evaluation (``evaluate``). Importing a submodule imports transformers;
``import s2attn`` alone never does."""
