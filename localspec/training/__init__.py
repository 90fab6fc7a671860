"""Training draft heads (EAGLE, EAGLE-3, Medusa) for a frozen target: corpus, cached target
features, the training loop and the acceptance measurement. Never imports the UI."""
