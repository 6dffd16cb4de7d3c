"""Model families and their layers: config, layer kinds, decoder, drafter."""
