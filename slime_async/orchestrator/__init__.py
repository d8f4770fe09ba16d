"""The orchestrator wing: the live run, from a checked `RunConfig` to a stopped run.

Owns start-up (`launch`: roles, weights, data plan, resume), the run between steps (`run`), the
async step loop (`controller`), the Ray roles and the router actor (`roles`), placement of roles
on nodes and cores (`placement`), engine supervision (`supervisor`), the per-sample generate
chain (`generate_chain`) and lost-node handling (`node_loss`, `node_paths`). Imports the config
wing and the components; nothing in them imports this package.
"""
