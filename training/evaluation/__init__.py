"""Forecast skill: WeatherBench 2 metrics, rollouts and scorecards, validation during training, figures."""
