"""`hybridserve timeline`: recorded engine steps as a self-contained HTML page and as Perfetto
trace-event JSON. records.py reads the file (and replays each step), view.py is the pure view
model, page.py / perfetto.py write it out, command.py is the command."""
