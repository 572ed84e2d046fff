"""The generator of the shipped text-to-SQL corpus (src/adarl/data/text_to_sql/): deterministic.

    python -m adarl.tasks.text_to_sql_corpus [--out DIR]     (default: the package's data folder)

Four SQLite databases of three tables each (shop, school, library, flights), their rows drawn from a
seeded `random.Random`, each written as a SQL script (`<db>.sql`: CREATE TABLE, then INSERTs); and
`questions.jsonl`, questions with gold queries from templates: filters, counts, averages, group-by,
order-by with limit, and joins over two or three tables. A template's instances whose gold result is
empty, NULL or (for an ordered one) tied at its cut are skipped, so every gold result is a definite
answer. Per template, at most PER_TEMPLATE instances are kept, and of those every fourth (in the
seeded order) is held out (`split: held_out`): the held-out set is other instances of the training
templates, on the same schemas (tasks/text_to_sql.py can hold out a whole database instead).

tests/tasks/test_text_to_sql.py regenerates the corpus and checks that the shipped files are its output.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED = 35
PER_TEMPLATE = 8
HELD_OUT_EVERY = 4  # of a template's kept instances, the 4th, 8th, ... are held out

FIRST = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Milo", "Nia",
         "Omar", "Pia", "Quin", "Rui", "Sana", "Teo", "Uma", "Vik", "Wen", "Xia", "Yara", "Zed", "Abe", "Bea",
         "Cyd", "Dora", "Emil", "Flo", "Gia", "Hugo", "Ines", "Jude", "Kira", "Lou", "Mara", "Noe"]
LAST = ["Stone", "Reyes", "Okafor", "Lind", "Moreau", "Sato", "Novak", "Haas", "Ortiz", "Berg", "Costa", "Dunn"]
CITIES = ["Lyon", "Porto", "Graz", "Turku", "Ghent", "Bergen"]
CATEGORIES = ["garden", "kitchen", "toys", "books", "sports"]
ADJECTIVES = ["red", "big", "quiet", "smart", "tiny", "bright", "soft", "fast", "round", "old", "cool", "light"]
NOUNS = {"garden": ["rake", "hose", "planter", "shovel"], "kitchen": ["kettle", "pan", "grater", "whisk"],
         "toys": ["kite", "robot", "puzzle", "yo-yo"], "books": ["atlas", "novel", "cookbook", "diary"],
         "sports": ["racket", "ball", "helmet", "mat"]}
HOUSES = ["Oak", "Pine", "Elm", "Ash"]
DEPARTMENTS = ["math", "art", "history", "science"]
COURSE_WORDS = ["Intro to", "Advanced", "Applied", "Modern"]
SUBJECTS = {"math": ["Algebra", "Geometry"], "art": ["Drawing", "Sculpture"], "history": ["Rome", "Empires"],
            "science": ["Physics", "Botany"]}
COUNTRIES = ["Chile", "Kenya", "Norway", "Japan", "Peru", "Italy"]
GENRES = ["mystery", "poetry", "fantasy", "travel", "biography"]
TITLE_WORDS = ["Winter", "River", "Glass", "Silent", "Paper", "Golden", "Hidden", "Last", "Northern", "Salt"]
TITLE_NOUNS = ["Garden", "Road", "House", "Song", "Letters", "Island", "Clock", "Harbor"]
AIRPORTS = [("LIM", "Lima", "Peru"), ("CUZ", "Cusco", "Peru"), ("SCL", "Santiago", "Chile"),
            ("PMC", "Puerto Montt", "Chile"), ("NBO", "Nairobi", "Kenya"), ("MBA", "Mombasa", "Kenya"),
            ("OSL", "Oslo", "Norway"), ("BGO", "Bergen", "Norway"), ("NRT", "Tokyo", "Japan"),
            ("KIX", "Osaka", "Japan"), ("FCO", "Rome", "Italy"), ("MXP", "Milan", "Italy")]
AIRLINES = ["Condor Air", "Savanna Wings", "Fjord Jet", "Sakura Lines", "Andes Air", "Tiber Flights",
            "Polar Express Air", "Coast Hopper"]


@dataclass
class Table:
    name: str
    columns: list[tuple[str, str]]  # (name, SQLite type); the first is the primary key
    rows: list[tuple]

    def create(self) -> str:
        cols = ", ".join(f"{n} {t}{' PRIMARY KEY' if i == 0 else ''}" for i, (n, t) in enumerate(self.columns))
        return f"CREATE TABLE {self.name} ({cols});"


def _literal(v: Any) -> str:
    return str(v) if isinstance(v, int) else "'" + str(v).replace("'", "''") + "'"


def script(tables: list[Table]) -> str:
    lines = [t.create() for t in tables]
    for t in tables:
        lines += [f"INSERT INTO {t.name} VALUES ({', '.join(map(_literal, row))});" for row in t.rows]
    return "\n".join(lines) + "\n"


def _people(rng: random.Random, n: int) -> list[str]:
    names = [f"{first} {last}" for first in FIRST for last in LAST]
    return rng.sample(names, n)


def _distinct(rng: random.Random, low: int, high: int, n: int, step: int = 1) -> list[int]:
    return rng.sample(range(low, high + 1, step), n)


def shop(rng: random.Random) -> list[Table]:
    names = _people(rng, 30)
    joined = _distinct(rng, 1990, 2024, 30)
    customers = [(i + 1, names[i], rng.choice(CITIES), joined[i]) for i in range(30)]
    products, prices, seen = [], _distinct(rng, 3, 400, 24), set()
    while len(products) < 24:
        category = CATEGORIES[len(products) % len(CATEGORIES)]
        name = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS[category])}"
        if name not in seen:
            seen.add(name)
            products.append((len(products) + 1, name, category, prices[len(products)]))
    orders = [(i + 1, rng.randint(1, 30), rng.randint(1, 24), rng.randint(1, 9), rng.randint(2021, 2024))
              for i in range(150)]
    return [Table("customers", [("id", "INTEGER"), ("name", "TEXT"), ("city", "TEXT"), ("joined", "INTEGER")],
                  customers),
            Table("products", [("id", "INTEGER"), ("name", "TEXT"), ("category", "TEXT"), ("price", "INTEGER")],
                  products),
            Table("orders", [("id", "INTEGER"), ("customer_id", "INTEGER"), ("product_id", "INTEGER"),
                             ("quantity", "INTEGER"), ("year", "INTEGER")], orders)]


def school(rng: random.Random) -> list[Table]:
    names = _people(rng, 36)
    points = _distinct(rng, 10, 500, 36)
    students = [(i + 1, names[i], rng.choice(HOUSES), rng.randint(9, 12), points[i]) for i in range(36)]
    titles = [f"{w} {s}" for d in DEPARTMENTS for s in SUBJECTS[d] for w in COURSE_WORDS[:2]]
    capacity = _distinct(rng, 12, 90, len(titles))
    courses = [(i + 1, t, next(d for d in DEPARTMENTS if t.split()[-1] in SUBJECTS[d]), rng.choice([2, 3, 4, 5]),
                capacity[i]) for i, t in enumerate(titles)]
    pairs = rng.sample([(s, c) for s in range(1, 37) for c in range(1, len(courses) + 1)], 120)
    enrollments = [(i + 1, s, c, rng.randint(40, 100)) for i, (s, c) in enumerate(pairs)]
    return [Table("students", [("id", "INTEGER"), ("name", "TEXT"), ("house", "TEXT"), ("grade", "INTEGER"),
                               ("points", "INTEGER")], students),
            Table("courses", [("id", "INTEGER"), ("title", "TEXT"), ("department", "TEXT"), ("credits", "INTEGER"),
                              ("capacity", "INTEGER")], courses),
            Table("enrollments", [("id", "INTEGER"), ("student_id", "INTEGER"), ("course_id", "INTEGER"),
                                  ("score", "INTEGER")], enrollments)]


def library(rng: random.Random) -> list[Table]:
    names, born = _people(rng, 20), _distinct(rng, 1900, 1995, 20)
    authors = [(i + 1, names[i], rng.choice(COUNTRIES), born[i]) for i in range(20)]
    titles = rng.sample([f"The {w} {n}" for w in TITLE_WORDS for n in TITLE_NOUNS], 40)
    pages = _distinct(rng, 80, 900, 40)
    books = [(i + 1, titles[i], rng.randint(1, 20), rng.choice(GENRES), pages[i], rng.randint(1950, 2024))
             for i in range(40)]
    members = _people(rng, 15)
    loans = [(i + 1, rng.randint(1, 40), rng.choice(members), rng.randint(1, 60)) for i in range(120)]
    return [Table("authors", [("id", "INTEGER"), ("name", "TEXT"), ("country", "TEXT"), ("born", "INTEGER")],
                  authors),
            Table("books", [("id", "INTEGER"), ("title", "TEXT"), ("author_id", "INTEGER"), ("genre", "TEXT"),
                            ("pages", "INTEGER"), ("year", "INTEGER")], books),
            Table("loans", [("id", "INTEGER"), ("book_id", "INTEGER"), ("member", "TEXT"), ("days", "INTEGER")],
                  loans)]


def flights(rng: random.Random) -> list[Table]:
    founded = _distinct(rng, 1920, 2015, len(AIRLINES))
    airlines = [(i + 1, name, rng.choice(COUNTRIES), founded[i]) for i, name in enumerate(AIRLINES)]
    distance = _distinct(rng, 150, 9000, 80, step=5)
    rows = []
    for i in range(80):
        origin, destination = rng.sample([a[0] for a in AIRPORTS], 2)
        airline = rng.randint(1, len(AIRLINES))
        number = f"{''.join(w[0] for w in AIRLINES[airline - 1].split()[:2]).upper()}{100 + i}"
        rows.append((i + 1, number, airline, origin, destination, distance[i], rng.choice([70, 120, 180, 240])))
    return [Table("airports", [("code", "TEXT"), ("city", "TEXT"), ("country", "TEXT")], list(AIRPORTS)),
            Table("airlines", [("id", "INTEGER"), ("name", "TEXT"), ("country", "TEXT"), ("founded", "INTEGER")],
                  airlines),
            Table("flights", [("id", "INTEGER"), ("number", "TEXT"), ("airline_id", "INTEGER"), ("origin", "TEXT"),
                              ("destination", "TEXT"), ("distance", "INTEGER"), ("seats", "INTEGER")], rows)]


@dataclass
class View:
    """A table seen by the generic templates: what its rows are called, a label, a category and a number."""

    table: str
    singular: str
    plural: str
    label: str
    label_noun: str
    category: str
    category_noun: str
    number: str
    number_noun: str


VIEWS = {
    "shop": [View("customers", "customer", "customers", "name", "name", "city", "city", "joined", "joining year"),
             View("products", "product", "products", "name", "name", "category", "category", "price", "price")],
    "school": [View("students", "student", "students", "name", "name", "house", "house", "points", "points"),
               View("courses", "course", "courses", "title", "title", "department", "department", "capacity",
                    "capacity")],
    "library": [View("authors", "author", "authors", "name", "name", "country", "country", "born", "birth year"),
                View("books", "book", "books", "title", "title", "genre", "genre", "pages", "number of pages")],
    "flights": [View("airlines", "airline", "airlines", "name", "name", "country", "country", "founded",
                     "founding year"),
                View("flights", "flight", "flights", "number", "number", "origin", "origin airport code", "distance",
                     "distance")],
}

# a template: name, ordered, and a function of (database, rng) yielding (question, gold sql) candidates
Candidates = Callable[[sqlite3.Connection], Iterator[tuple[str, str]]]


def _values(db: sqlite3.Connection, sql: str) -> list[Any]:
    return [r[0] for r in db.execute(sql)]


def generic(v: View) -> list[tuple[str, bool, Candidates]]:
    t, c, n, lab = v.table, v.category, v.number, v.label
    cats = lambda db: _values(db, f"SELECT DISTINCT {c} FROM {t} ORDER BY {c}")  # noqa: E731
    nums = lambda db: _values(db, f"SELECT {n} FROM {t} ORDER BY {n}")[2:-2]  # noqa: E731

    def list_filter(db):
        for x in cats(db):
            yield (f"List the {v.label_noun}s of the {v.plural} whose {v.category_noun} is {x}.",
                   f"SELECT {lab} FROM {t} WHERE {c} = {_literal(x)}")

    def count_above(db):
        for x in nums(db):
            yield f"How many {v.plural} have a {v.number_noun} above {x}?", f"SELECT COUNT(*) FROM {t} WHERE {n} > {x}"

    def average(db):
        for x in cats(db):
            yield (f"What is the average {v.number_noun} of the {v.plural} whose {v.category_noun} is {x}?",
                   f"SELECT AVG({n}) FROM {t} WHERE {c} = {_literal(x)}")

    def group_count(db):
        for x in nums(db):
            yield (f"For each {v.category_noun}, how many {v.plural} have a {v.number_noun} above {x}?",
                   f"SELECT {c}, COUNT(*) FROM {t} WHERE {n} > {x} GROUP BY {c}")

    def top(db):
        for k in range(2, 7):
            for word, way in (("highest", "DESC"), ("lowest", "ASC")):
                yield (f"Which {k} {v.plural} have the {word} {v.number_noun}? List their {v.label_noun}s, "
                       f"the {word} first.", f"SELECT {lab} FROM {t} ORDER BY {n} {way} LIMIT {k}")

    def lowest_in(db):
        for x in cats(db):
            yield (f"Which of the {v.plural} whose {v.category_noun} is {x} has the lowest {v.number_noun}? "
                   f"Give its {v.label_noun}.",
                   f"SELECT {lab} FROM {t} WHERE {c} = {_literal(x)} ORDER BY {n} ASC LIMIT 1")

    return [(f"{t}/list_filter", False, list_filter), (f"{t}/count_above", False, count_above),
            (f"{t}/average", False, average), (f"{t}/group_count", False, group_count),
            (f"{t}/top", True, top), (f"{t}/lowest_in", False, lowest_in)]


def joins(name: str) -> list[tuple[str, bool, Candidates]]:
    def q(sql):
        return lambda db: _values(db, sql)

    if name == "shop":
        return [
            ("join/customers_by_category", False, lambda db: (
                (f"List the names of the customers from {city} who ordered a product in the {cat} category.",
                 "SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id JOIN products p "
                 f"ON p.id = o.product_id WHERE c.city = '{city}' AND p.category = '{cat}'")
                for city in CITIES for cat in CATEGORIES)),
            ("join/quantity_by_year", False, lambda db: (
                (f"What is the total quantity of {cat} products ordered in {year}?",
                 "SELECT SUM(o.quantity) FROM orders o JOIN products p ON p.id = o.product_id "
                 f"WHERE p.category = '{cat}' AND o.year = {year}")
                for cat in CATEGORIES for year in range(2021, 2025))),
            ("join/orders_per_city", False, lambda db: (
                (f"For each city, how many orders did its customers place in {year}?",
                 "SELECT c.city, COUNT(*) FROM orders o JOIN customers c ON c.id = o.customer_id "
                 f"WHERE o.year = {year} GROUP BY c.city") for year in range(2021, 2025))),
        ]
    if name == "school":
        return [
            ("join/students_in_course", False, lambda db: (
                (f"List the names of the students enrolled in {title}.",
                 "SELECT s.name FROM students s JOIN enrollments e ON e.student_id = s.id JOIN courses c "
                 f"ON c.id = e.course_id WHERE c.title = '{title}'")
                for title in q("SELECT title FROM courses ORDER BY id")(db))),
            ("join/department_average", False, lambda db: (
                (f"What is the average score of the enrollments in the courses of the {d} department?",
                 "SELECT AVG(e.score) FROM enrollments e JOIN courses c ON c.id = e.course_id "
                 f"WHERE c.department = '{d}'") for d in DEPARTMENTS)),
            ("join/house_scores", False, lambda db: (
                (f"How many students of house {h} scored above {x} in at least one course?",
                 "SELECT COUNT(DISTINCT s.id) FROM students s JOIN enrollments e ON e.student_id = s.id "
                 f"WHERE s.house = '{h}' AND e.score > {x}") for h in HOUSES for x in (60, 75, 90))),
        ]
    if name == "library":
        return [
            ("join/books_by_author", False, lambda db: (
                (f"List the titles of the books written by {a}.",
                 f"SELECT b.title FROM books b JOIN authors a ON a.id = b.author_id WHERE a.name = '{a}'")
                for a in q("SELECT name FROM authors ORDER BY id")(db))),
            ("join/long_loans", False, lambda db: (
                (f"How many loans of {g} books lasted more than {d} days?",
                 "SELECT COUNT(*) FROM loans l JOIN books b ON b.id = l.book_id "
                 f"WHERE b.genre = '{g}' AND l.days > {d}") for g in GENRES for d in (10, 30, 45))),
            ("join/books_per_country", False, lambda db: (
                (f"For each country of the authors, how many of their books were published after {y}?",
                 "SELECT a.country, COUNT(*) FROM books b JOIN authors a ON a.id = b.author_id "
                 f"WHERE b.year > {y} GROUP BY a.country") for y in (1960, 1980, 2000, 2010))),
        ]
    return [
        ("join/flights_from_city", False, lambda db: (
            (f"List the numbers of the flights that leave from {city}.",
             f"SELECT f.number FROM flights f JOIN airports a ON a.code = f.origin WHERE a.city = '{city}'")
            for _, city, _ in AIRPORTS)),
        ("join/airline_to_country", False, lambda db: (
            (f"How many flights does {airline} operate to airports in {country}?",
             "SELECT COUNT(*) FROM flights f JOIN airlines l ON l.id = f.airline_id JOIN airports a "
             f"ON a.code = f.destination WHERE l.name = '{airline}' AND a.country = '{country}'")
            for airline in AIRLINES for country in sorted({a[2] for a in AIRPORTS}))),
        ("join/seats_long_flights", False, lambda db: (
            (f"What is the total number of seats on the flights of {airline} longer than {d}?",
             "SELECT SUM(f.seats) FROM flights f JOIN airlines l ON l.id = f.airline_id "
             f"WHERE l.name = '{airline}' AND f.distance > {d}") for airline in AIRLINES for d in (1000, 4000))),
    ]


BUILDERS: dict[str, Callable[[random.Random], list[Table]]] = {
    "shop": shop, "school": school, "library": library, "flights": flights}


def _definite(db: sqlite3.Connection, sql: str, ordered: bool) -> bool:
    """A gold result worth asking for: some rows, no NULL, no zero count, no tie at an ordered cut."""
    rows = db.execute(sql).fetchall()
    if not rows or any(v is None for r in rows for v in r) or rows == [(0,)]:
        return False
    if ordered and " LIMIT " in sql:
        head, _, k = sql.rpartition(" LIMIT ")
        order = head.rpartition(" ORDER BY ")[2].split()[0]
        table = head.split(" FROM ")[1].split()[0]
        values = [r[0] for r in db.execute(f"SELECT {order} FROM {table} ORDER BY {order} "
                                           f"{head.rpartition(' ')[2]} LIMIT {int(k) + 1}")]
        return len(set(values)) == len(values)
    return True


def build(seed: int = SEED) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """(each database's SQL script, the questions), all drawn from `seed`."""
    scripts: dict[str, str] = {}
    questions: list[dict[str, Any]] = []
    for name, builder in BUILDERS.items():
        rng = random.Random(f"{seed}:{name}")
        scripts[name] = script(builder(rng))
        db = sqlite3.connect(":memory:")
        db.executescript(scripts[name])
        templates = [t for v in VIEWS[name] for t in generic(v)] + joins(name)
        for template, ordered, candidates in templates:
            found = list(dict.fromkeys(candidates(db)))
            rng.shuffle(found)
            kept = [(qn, sql) for qn, sql in found if _definite(db, sql, ordered)][:PER_TEMPLATE]
            for i, (question, sql) in enumerate(kept):
                questions.append({"id": f"{name}/{template}/{i}", "db": name, "template": f"{name}/{template}",
                                  "question": question, "sql": sql, "ordered": ordered,
                                  "split": "held_out" if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train"})
        db.close()
    return scripts, questions


def write(out: Path, seed: int = SEED) -> None:
    """Write the corpus (`<db>.sql` and `questions.jsonl`) into `out`, a folder. A name there that is not a
    regular file (a FIFO would block the write forever, a device or a folder is not the corpus) is an error,
    before anything is written."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"the corpus seed must be an integer, got {seed!r}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: not a folder")
    for name in [*(f"{db}.sql" for db in BUILDERS), "questions.jsonl"]:
        target = out / name
        if target.is_symlink() or (target.exists() and not target.is_file()):
            raise ValueError(f"{target}: not a regular file (a link, FIFO, device or folder); the corpus is not "
                             "written over it")
    scripts, questions = build(seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in scripts.items():
        (out / f"{name}.sql").write_text(text, encoding="utf-8")
    (out / "questions.jsonl").write_text("".join(json.dumps(q, sort_keys=True) + "\n" for q in questions),
                                         encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "text_to_sql")
    try:
        write(parser.parse_args().out)
    except (ValueError, OSError) as err:
        parser.exit(2, f"error: {err}\n")


if __name__ == "__main__":
    main()
