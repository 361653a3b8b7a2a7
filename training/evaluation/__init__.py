"""Forecast skill: WeatherBench 2 metrics, rollouts and scorecards, validation during training, figures, the
Forecaster, and comparing finished runs (``run_comparison.py``)."""
