"""Document models for ``task: document``: the model families (:mod:`.family`), page words (:mod:`.words`)."""
