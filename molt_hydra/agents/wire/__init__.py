"""The loopback chat server that agents reach with the stock `openai` / `anthropic` SDKs (Molt §3.5).

`server.py` is the HTTP side; one module per API turns its requests into one `ChatRequest` (`request.py`, the one
request check) and replies into its bodies and streamed events (`openai_chat.py`, `completions.py`, `responses.py`,
`anthropic.py`, over `stream.py`); `session.py` is the one token-capture path: it renders, generates and records the
exact token ids and log-probs of every turn.
"""
