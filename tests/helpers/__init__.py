"""What the test modules share: checkpoints, tokenizers and inputs built here, the servers and
rank processes they start, and the files run in child processes. Imported as ``helpers.<module>``
(tests/ is on sys.path through its conftest)."""
