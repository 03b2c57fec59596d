"""What the encoder tasks (embed, rerank, classify, NER) share, written once.

- :mod:`.limits`: the longest input a model takes (:func:`~.limits.input_limit`, which knows the
  position tables of the RoBERTa family) and the one ``context_length_exceeded`` error;
- :mod:`.padding`: padded ``input_ids`` / ``attention_mask`` / ``token_type_ids`` for a batch;
- :mod:`.args`: the engine arguments every encoder takes (batching, device, dtype, input cap);
- :mod:`.base`: :class:`~.base.EncoderPredictor`, the predictor base of the four tasks, and the
  transformers loading they share;
- :mod:`.embedding`: the embedding engines (sentence-transformers / transformers, llama.cpp) behind a
  micro-batcher, used by ``embed`` and by ``rerank``'s bi-encoder mode;
- :mod:`.texts`: a transformers encoder with a task head over ``texts`` requests (classify, NER).

The task modules (``tasks/embed.py`` ...) hold only what is their own: request models, the head's
scoring, the routes. No task module imports another.
"""
