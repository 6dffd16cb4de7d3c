"""Training the bundled pair: data, losses, the loop."""
