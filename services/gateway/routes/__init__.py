"""The HTTP handlers, one module per part of the API, each listing its routes (`ROUTES`, and
`PUBLIC_ROUTES` or the console's and operator's lists) for `app.py` to mount under one access
policy. Handlers only: what several of them need lives in a room (`http/`, `accounts/`,
`catalog/`, `sampling/`, `wire/`) or beside `submit.py`, and no route module imports another."""
