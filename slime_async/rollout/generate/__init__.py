"""The generate hot path: one data-worker sample to one engine `/generate` call (`client`), the
forward-only role's log-probs as samples finish (`behavior`), and completed groups to the
trainer's batch (`assemble`: scoring, advantages, padded tensors).
"""
