"""The helpers the tests share: one home for each shared model and harness.

- ``environment``: what this environment can run (``HAS_TORCH``, ``has("training")``) and
  where the repository's files are (``ROOT``, ``GOLDEN_MODELS``);
- ``models``: small models written in ONNX text syntax (``model(signature, body)``);
- ``linear``: the small linear regression model and its data, the problem the training
  tests share;
- ``gradcheck``: a gradient checked against finite differences (and the training build);
- ``torch_steps``: lossgraph's training steps and gradients against torch's, and torch's
  legacy export with a free batch (``legacy_export``);
- ``data_propagation``: a program whose epoch graph packs long vectors, the models onnx's
  data propagation sees and the long vectors in them (graphs/test_facts.py,
  speed/test_specialize_batch.py);
- ``fixed_batch``: models exported with a fixed batch, freed or kept by GeneralizeBatch,
  and an export run in runs of its own batch (passes/test_fixed_batch.py,
  test_fixed_batch.py);
- ``adapters``: the small models of the LoRA adapter files' and compositions' tests
  (export/test_adapters.py, test_lora_compositions.py);
- ``estimators``: data, models and numpy references of the onnxcustom estimators' tests;
- ``catalogue``: the bad-input tables of docs/reference/errors.md
  (``PYTHONPATH=. python tests/support/catalogue.py`` rewrites them);
- ``supported_models``: the supported-models catalogue behind docs/supported_models.md
  (``PYTHONPATH=. python tests/support/supported_models.py`` runs it and writes the record
  and the page; tests/test_supported_models.py);
- ``fuzzing``: the fuzzer's examples, property and sandbox process (tests/test_fuzz.py;
  ``python tests/support/fuzzing.py FAMILY EXAMPLES SEED`` explores outside pytest);
- ``node_audit``: the ONNX backend node tests as a gradient audit
  (``python tests/support/node_audit.py``, docs/gradient_audit.md).
"""
