"""The kvsnap command line: a thin typer app over the ``kvsnap`` library."""
