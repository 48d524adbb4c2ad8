"""Input pipelines: records -> tokens -> packed [B_local, T] batches for the train step.

  sources.py           JSONL / Parquet / ArrayRecord / stdlib records, local or gs://
  stdlib_corpus.py     the embedded default corpus and its train / heldout split
  kimi_vocab.py        Kimi's pre-tokenizer regex and special-token layout
  tokenizer.py         the tokenizer interface; HF tokenizer.json and Kimi tiktoken loaders
  default_tokenizer.py the stdlib-trained byte-level BPE, cached in the workdir
  chat.py              Kimi's chat / tool-call template and assistant masks
  examples.py          records -> {tokens, loss_mask} examples; cutting long ones
  packing.py           first-fit packing and the batch contract
  pipeline.py          make_lm_iterator / make_sft_iterator (checkpointable)
  corpus_stats.py      unigram entropy (nats), chars per token
"""
