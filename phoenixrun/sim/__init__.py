"""Cost model (`model`) and Monte Carlo simulator (`montecarlo`) behind `phoenixrun simulate` (`cli`)."""

from phoenixrun.sim.model import Scenario, exact_prediction, paper_prediction
from phoenixrun.sim.montecarlo import PRESETS, run

__all__ = ["PRESETS", "Scenario", "exact_prediction", "paper_prediction", "run"]
