"""Data directories: `eggroll-data` (cli.py) and the library it runs, which `eggroll-local`
and the tests use too. Text becomes documents (documents.py, builtin.py), documents become a
data directory (build.py, tokenizer.py, baselines.py), or a d-eggs directory is imported
(import_deggs.py)."""
