"""The run's settings: the strict pydantic base, the fields both recipes share, the trainer's and the deployment's
sections, and the Fireworks cookbook's names resolved into them."""
