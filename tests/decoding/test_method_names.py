"""Method names are parsed into options (align/decoding/options.py): today's names are aliases of option sets, a
spelling in the grammar (specdiff+cps+tree) names the same method, and the recipe keeps the name."""

import pytest

from align.config import METHOD_NAMES, RecipeError
from align.decoding.options import MethodOptions, method_name, parse_method
from align.recipe_files import load_recipe

# The names recipes, eval.json rows and tests have used: every one must keep working.
TODAYS_NAMES = ("ar", "hf_generate", "hf_assisted", "prompt_lookup", "sd_ar", "specdiff", "specdiff2_select",
                "specdiff_cps", "specdiff_adl", "specdiff_cps_adl", "specdiff_tree", "specdiff_cost",
                "specdiff_cps_cost", "specdiff_tree_cost", "specdiff_cps_tree", "specdiff_cps_tree_cost")
# The model-free drafts (issue 37), n-gram and SuffixDecoding: alone, together, and joined to the drafter's tree.
MODEL_FREE_NAMES = ("ngram", "ngram_cost", "suffix", "suffix_cost", "suffix_ngram", "suffix_ngram_cost")
UNION_NAMES = tuple(f"specdiff{cps}{ngram}{suffix}_tree{cost}" for cps in ("", "_cps") for ngram in ("", "_ngram")
                    for suffix in ("", "_suffix") for cost in ("", "_cost") if ngram or suffix)
NGRAM_NAMES = MODEL_FREE_NAMES + UNION_NAMES


def test_the_grammar_allows_exactly_todays_methods():
    assert sorted(METHOD_NAMES) == sorted(TODAYS_NAMES + NGRAM_NAMES)


@pytest.mark.parametrize("name", TODAYS_NAMES + NGRAM_NAMES)
def test_a_name_and_its_spelling_are_one_method(name):
    method = parse_method(name)
    assert method.name == name
    assert parse_method(method.spelled) == method
    assert parse_method("+".join([method.base, *reversed(method.options)])) == method  # options in any order


def test_spellings_name_their_options():
    assert parse_method("specdiff+tree+cost+cps") == MethodOptions("specdiff", ("cps", "tree", "cost"))
    assert method_name("specdiff+cps+tree+cost") == "specdiff_cps_tree_cost"
    assert method_name("specdiff+select") == "specdiff2_select"
    assert "adl" in parse_method("specdiff_cps_adl") and "tree" not in parse_method("specdiff_cps_adl")


@pytest.mark.parametrize("text, why", [
    ("medusa", "unknown base 'medusa'"), ("specdiff+beam", "unknown option 'beam'"),
    ("sd_ar+cps", "sd_ar takes no options"), ("specdiff+cps+cps", "an option named twice"),
    ("specdiff+select+tree", "select"), ("specdiff+adl+tree", "adl"), ("specdiff+adl+cost", "adl and cost"),
    ("specdiff_tree_cps", "unknown base 'specdiff_tree_cps'"),  # aliases are today's names only
    ("specdiff+ngram", "ngram joins the n-gram continuation to the drafter's tree: it needs tree"),
    ("ngram+tree", "ngram takes only cost"), ("specdiff+suffix+cost", "suffix joins SuffixDecoding's candidates"),
    ("suffix+tree", "suffix takes only ngram, cost"),
])
def test_a_bad_name_is_one_line_saying_why(text, why):
    with pytest.raises(ValueError) as caught:
        parse_method(text)
    message = str(caught.value)
    assert why in message and "\n" not in message and "specdiff_cps_tree_cost" in message


def test_a_recipe_keeps_the_name_of_a_spelling_and_refuses_a_bad_one():
    recipe = load_recipe("recipes/tiny/eval.yaml", ["eval.methods=[specdiff+tree+cps, sd_ar]"])
    assert recipe.eval.methods == ["specdiff_cps_tree", "sd_ar"]
    with pytest.raises(RecipeError, match=r"^eval\.methods\[0\]: method 'specdiff\+adl\+tree': adl adapts"):
        load_recipe("recipes/tiny/eval.yaml", ["eval.methods=[specdiff+adl+tree]"])
