"""Tree-of-Thought search core: tree, policies, rewards, answers, tasks, the search driver."""
