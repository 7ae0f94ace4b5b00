"""The front ends: IPython magics, the cell job, views, the CLI and the headless notebook runner.

The only place that imports IPython or ipywidgets.
"""
