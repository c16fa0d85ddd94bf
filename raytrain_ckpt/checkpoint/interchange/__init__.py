"""Export and import: one committed step to HF safetensors or ``torch.save``, streamed; a ``torch.save``
file or an HF directory to a model-only step 0. Model-specific names come from the model's ``HFAdapter``
(``raytrain_ckpt/models/hf.py``). Imports ``format``, ``storage`` and ``policy``."""
