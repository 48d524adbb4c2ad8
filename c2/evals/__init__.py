"""Evaluation suites and figures (python -m c2.eval; train.eval_suites in training).

  passk.py           unbiased pass@k
  probe_model.py     log-probs of token rows and greedy completions of one checkpoint
  codebase_loss.py   total nats over a rolling window (tokenizer-independent)
  state_tracking.py  reconstruct a file after a chain of diffs (character distance)
  knowledge.py       question/answer pairs, exact match
  long_context.py    loss by position, needle and variable tracking by length
  agentic.py         held-out environment tasks: pass@k, rewards, tokens, tool calls, cost
  suites.py          the suites by name, SuiteOptions, run_suites
  plots.py           Pareto, pass@k, context-length and probe figures (PNG, SVG, JSON)
  report.py          results.json across checkpoints, the table, figures to TensorBoard
"""
