"""Search: Optuna studies per (problem, backend), a worker process, run-folder storage.

Imports optuna; the serving path (table, ops, integrations) never imports this package.
"""
