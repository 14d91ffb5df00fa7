"""Small built-in vocabularies for the text environments (lowercase letters only)."""

WORDS = (
    "apple acorn anchor arrow badge bagel banana basket beacon berry blanket bottle bridge bucket butter "
    "cabin camera candle canyon carpet castle cherry circle cliff cloud comet copper cotton crayon desert "
    "dinner dolphin donkey dragon eagle echo engine falcon feather fiddle forest fossil garden garlic giant "
    "ginger glacier goblet grape guitar hammer harbor helmet honey island jacket jigsaw kettle kitten ladder "
    "lantern lemon lizard magnet mango marble meadow mirror monkey mountain napkin needle nickel noodle ocean "
    "olive orange orbit paddle pepper pencil pillow planet pocket puzzle quartz rabbit raven ribbon river "
    "rocket saddle salmon silver spider spoon squirrel summit sunset table tiger timber tomato tunnel turtle "
    "umbrella valley velvet violin wagon walnut window winter wizard yogurt zebra"
).split()

# Names for the logic puzzles: none is a substring of another, all start with different letters.
NAMES = (
    "Alice",
    "Bruno",
    "Clara",
    "Dmitri",
    "Elena",
    "Farid",
    "Greta",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemal",
    "Leila",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
)
