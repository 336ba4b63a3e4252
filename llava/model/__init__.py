"""The checkpoint: loading it, its prompt, what an image becomes before the processor.

- ``loading``: a llava-hf checkpoint directory → processor, model, prompt, special ids.
- ``prompt``: ``ChatPrompt``, the conversation as the checkpoint's own chat template renders it.
- ``imageprep``: the image kept whole (LLaVA-1.5's ``pad``).
- ``reference``: the model's own forward on a DynamicCache, which tests check the runner against.
- ``weights_digest``: a digest of the weight values, so that a fine-tune of the same shape is
  another model to the persistent tier.

Invariants: nothing here reaches a model hub; a turn's prompt ids are exactly what the
checkpoint's template and tokenizer give for the whole conversation.
"""
