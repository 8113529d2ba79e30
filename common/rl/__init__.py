"""What train_ppo.py and train_grpo.py share: the run, the workers, rewards, evaluation."""
