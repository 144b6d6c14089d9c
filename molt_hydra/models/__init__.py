"""Actor / reference / critic construction and the log-prob forward (see build.py, logprobs.py)."""
