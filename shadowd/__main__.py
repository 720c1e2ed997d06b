"""``python -m shadowd`` is the ``shadowd`` command."""

from shadowd.cli import app

if __name__ == "__main__":  # the collector's writer process imports this module again under another name
    app()
