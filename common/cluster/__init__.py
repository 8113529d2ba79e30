"""Ray actor groups, and what runs where and whether it fits (--dry_run)."""
