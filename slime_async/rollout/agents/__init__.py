"""Rollouts written as programs: agent functions over the training gateway (OpenAI's chat API,
token in, token out) and slime-style custom generate functions (multi-turn, tool use).
"""
