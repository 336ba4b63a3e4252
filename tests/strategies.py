"""Hypothesis strategies shared by the property tests."""

from hypothesis import strategies as st

# Any JSON value, nested a little: what a client can put in any field of a request body.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=20,
)
