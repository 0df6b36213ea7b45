"""What several test modules share: models and training loops, hostile-input campaigns, recipe fixtures."""
