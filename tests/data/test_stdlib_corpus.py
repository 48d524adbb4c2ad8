"""The embedded stdlib corpus: deterministic, disjoint train / held-out split."""
from c2.data import stdlib_corpus


def test_split_is_disjoint_deterministic_and_about_two_percent():
  train = stdlib_corpus.stdlib_files("train")
  heldout = stdlib_corpus.stdlib_files("heldout")
  assert not set(train) & set(heldout)
  assert train == stdlib_corpus.stdlib_files("train")
  assert 0.005 < len(heldout) / (len(train) + len(heldout)) < 0.05
  root = stdlib_corpus.stdlib_root()
  for path in train + heldout:
    relative = path.relative_to(root)
    assert path.suffix == ".py"
    assert not {"site-packages", "test", "tests"} & set(relative.parts[:-1])


def test_split_depends_only_on_relative_path():
  assert stdlib_corpus.split_of("json/__init__.py") == stdlib_corpus.split_of("json/__init__.py")
  shares = [stdlib_corpus.split_of(f"pkg/module_{i}.py") for i in range(5000)]
  assert 0.01 < shares.count("heldout") / len(shares) < 0.03


def test_corpus_yields_source_text():
  documents = list(stdlib_corpus.stdlib_corpus("heldout"))
  assert len(documents) == len(stdlib_corpus.stdlib_files("heldout"))
  assert all(isinstance(d, str) and d for d in documents)


def test_training_subset_is_bounded_and_stable():
  subset = list(stdlib_corpus.training_subset(300_000))
  size = sum(len(d.encode()) for d in subset)
  assert 300_000 <= size < 300_000 + max(len(d.encode()) for d in subset)
  assert subset == list(stdlib_corpus.training_subset(300_000))
