"""``python app.py``: the LocalSpec chat in your browser (see ``localspec/ui/launch.py``)."""

from localspec.ui.launch import main

if __name__ == "__main__":
    main()
