"""Training and evaluating HHST language models: ``s2attn train`` and ``s2attn eval``.

- the model: ``presets`` (shapes, recipes, the transformers config of each variant);
- the data: ``vocab`` (bytes and four specials), ``data`` (the source-file corpus and the token
  stream), ``needles`` (retrieval samples);
- training: ``options`` (the command's options, each declared once), ``run_plan`` (every input
  checked before anything is written), ``run_directory`` (the output directory, its lock and
  record), ``train`` (the loop), ``checkpoints``, ``metrics``;
- evaluation: ``evaluate`` (bits per byte, the needle grid, ``s2attn eval``), ``model_dir`` (a
  saved model read back), ``tasks`` (synthetic long-context tasks), ``positions`` (bits per byte
  by position), ``intervals``, ``scoring`` (what they all score with).

``import s2attn`` alone imports none of these (nor transformers, which most of them import).
"""
