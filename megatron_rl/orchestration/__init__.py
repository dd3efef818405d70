"""Ray placement and rank worker groups; the RL driver loop lands here (issue 6)."""
