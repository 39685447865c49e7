"""GRPO on the mlite runtime: the algorithm (`algorithm`), rewards (`rewards`), the built-in rollout
(`rollout`) and the training loop (`trainer`). No Ray or vLLM needed; verl drives the same runtime through
`mlite.integrations.verl`.
"""
