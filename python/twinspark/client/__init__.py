"""Clients of a running deployment: smoke test, throughput bench, weight/KV budget, GB10 forecast, Pi installer,
and the chat-template parity check. Each module is small and usable from Python; tasks.py wraps them."""
