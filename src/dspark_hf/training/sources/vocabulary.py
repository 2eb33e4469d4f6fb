"""Word lists and templates of the generated prompts (written here; topics are generic, not taken from any
benchmark): chat topics, activities, roles and letters; saying and word templates; programming tasks and languages;
passage templates; names, items and kinds of math exercises."""

TOPICS = """the ocean; volcanoes; honeybees; the moon; friendship; rainy days; city parks; public libraries; coffee;
tea ceremonies; bicycles; trains; the printing press; electricity; solar power; wind turbines; recycling; compost;
houseplants; autumn leaves; winter mornings; mountain hiking; deserts; rainforests; coral reefs; penguins; owls;
octopuses; dogs; cats; horses; elephants; migrating birds; the night sky; black holes; comets; Mars; the internet;
smartphones; video games; board games; chess; jazz music; classical music; street food; bread baking; chocolate;
spices; farmers' markets; lighthouses; bridges; skyscrapers; ancient Rome; the Silk Road; medieval castles; pirates;
the Olympic Games; marathon running; swimming; yoga; sleep; dreams; memory; habits; procrastination; kindness;
gratitude; curiosity; learning a new language; handwriting; poetry; museums; photography; painting; pottery;
knitting; woodworking; gardening; beekeeping; camping; road trips; maps; time zones; calendars; clocks; weather
forecasts; hurricanes; earthquakes; glaciers; rivers; islands; caves; dinosaurs; fossils; evolution; DNA; vaccines;
the human heart; nutrition; breakfast; soup; picnics; birthdays; weddings; holidays; grandparents; teachers;
nurses; firefighters; astronauts; inventors; robots; artificial intelligence; electric cars; airports; submarines;
money; banks; saving money; budgeting; small businesses; remote work; job interviews; teamwork; leadership;
public speaking; negotiation; volunteering; neighbours; moving house; minimalism; clutter; rainbows; thunderstorms;
snow; fog; sunsets; tides; the water cycle; soil; forests; mushrooms; wolves; whales; ants; spiders; butterflies;
the alphabet; numbers; zero; infinity; puzzles; magic tricks; circuses; theatre; cinema; cartoons; comic books;
fairy tales; myths; libraries of the future; time travel; secret codes; postcards; letters; diaries; umbrellas;
shoes; hats; keys; mirrors; candles; lanterns; windmills; sailing; kites; hot-air balloons; the first airplane"""
TOPICS = [t.strip() for t in TOPICS.replace("\n", " ").split(";") if t.strip()]

CHAT_TEMPLATES = [
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Write a short story (under 200 words) that involves {t}.",
    "Explain {t} to a ten-year-old.",
    "Give me five interesting facts about {t}.",
    "What are the most common misconceptions about {t}?",
    "Write a persuasive paragraph arguing that {t} deserves more attention.",
    "Describe {t} in three sentences.",
    "Compose a friendly email inviting a colleague to a talk about {t}.",
    "Write a limerick about {t}.",
    "Create a short quiz with three questions about {t}, and give the answers.",
    "What would the world be like without {t}?",
    "Write a dialogue between a teacher and a student about {t}.",
    "Summarize the history of {t} in one paragraph.",
    "List the pros and cons of {t}.",
    "Write a tweet-length announcement about {t}.",
    "Suggest a title and an outline for a blog post about {t}.",
    "How would you explain {t} to someone from the eighteenth century?",
    "Give an analogy that helps explain {t}.",
    "Write a diary entry from the point of view of someone who loves {t}.",
    "What questions should I ask an expert on {t}?",
    "Write a short news report about a surprising discovery related to {t}.",
    "Write a riddle whose answer is {t}.",
    "How might {t} change over the next fifty years?",
    "Write the opening of a children's story featuring {t}.",
    "Why does {t} matter in everyday life?",
    "Write a short review of an imaginary book about {t}.",
    "Brainstorm ten creative project ideas involving {t}.",
    "Write a four-line rhyming verse about {t}.",
    "Tell me something about {t} that most people do not know.",
    "Write a product description for a gadget inspired by {t}.",
    "Describe {t} using all five senses.",
    "Write a motivational message that uses {t} as a metaphor.",
    "What is the connection between {t} and science?",
    "Write a short speech for a school assembly about {t}.",
    "Explain {t} in exactly two sentences.",
]

ACTIVITIES = """learning to cook; running a first marathon; learning the guitar; studying for exams; training a puppy;
starting a vegetable garden; learning to code; improving my handwriting; reading more books; waking up earlier;
drawing portraits; learning to swim; saving for a holiday; writing a novel; keeping a journal; learning to juggle;
planning a wedding; moving to a new city; speaking in public; learning chess; meditating; eating more vegetables;
cycling to work; organising my desk; learning photography; making new friends; reducing screen time; baking bread;
learning to knit; training for a hike; managing my time; preparing for a job interview; learning to dance;
writing better emails; learning to paint with watercolours; caring for houseplants; learning sign language;
building a birdhouse; running a book club; volunteering locally""".replace("\n", " ")
ACTIVITIES = [a.strip() for a in ACTIVITIES.split(";") if a.strip()]

ADVICE_TEMPLATES = [
    "Give me practical tips for {a}.",
    "Make a four-week plan for {a}.",
    "What mistakes do beginners make when {a}?",
    "What do I need to get started with {a}?",
    "How can I stay motivated when {a}?",
    "I have thirty minutes a day. How should I use them for {a}?",
    "What are three small first steps for {a}?",
    "How do I measure my progress in {a}?",
]

ROLES = ["student", "retired teacher", "nurse working night shifts", "software developer", "parent of two",
         "small business owner", "university professor", "farmer", "truck driver", "musician", "chef", "librarian",
         "teenager", "new manager", "freelance designer", "graduate student", "shop assistant", "pilot",
         "social worker", "engineer", "writer", "gardener", "athlete", "doctor", "bus driver"]  # fmt: skip

LETTER_KINDS = ["email", "letter", "short note", "text message", "memo", "thank-you card", "cover letter"]
TONES = ["formal", "friendly", "apologetic", "enthusiastic", "polite but firm", "humorous", "concise"]
RECIPIENTS = ["my landlord", "a neighbour", "my manager", "a customer", "my team", "an old friend",
              "the school principal", "a hotel", "the city council", "a new colleague", "my grandmother"]  # fmt: skip
LETTER_SUBJECTS = ["a late payment", "a noisy party", "a project deadline", "a broken heater", "a job offer",
                   "a surprise party", "a lost package", "a team lunch", "a cancelled meeting", "a birthday gift",
                   "a volunteer day", "a parking problem", "a new schedule", "a thank-you for help",
                   "a request for a reference", "a schedule change", "a refund request"]  # fmt: skip

FORTUNE_TEMPLATES = [
    'What does this saying mean?\n\n"{f}"',
    "Explain the idea or the joke behind the following:\n\n{f}",
    "Write a short story inspired by this:\n\n{f}",
    "Do you agree with the following? Give arguments for and against.\n\n{f}",
    "Rewrite the following in plain, modern English:\n\n{f}",
    "In what situation might someone say this?\n\n{f}",
    "Write a short poem that starts from this idea:\n\n{f}",
]

WORD_TEMPLATES = [
    "What does the word '{w}' mean? Use it in two example sentences.",
    "Write a sentence using '{w}' in the sense of \"{g}\".",
    "Explain the meaning of '{w}' ({p}: {g}) and give a synonym.",
    "Is '{w}' a common word? Explain its meaning and where it is used.",
    "Write a short paragraph that uses the {p} '{w}' naturally.",
]
SYNONYM_TEMPLATES = [
    "Are '{a}' and '{b}' synonyms? Explain any difference in how they are used.",
    "When would you say '{a}' rather than '{b}'?",
]

CODE_TASKS = """reverse a singly linked list; check whether a string is a palindrome; merge two sorted lists;
find the second largest number in a list; count word frequencies in a text; implement binary search;
remove duplicates from a list while keeping order; flatten a nested list; parse a date string like 2024-03-15;
validate an email address with a regular expression; compute the Fibonacci numbers iteratively; implement a stack;
implement a queue with two stacks; rotate a matrix by 90 degrees; find all primes below n with a sieve;
convert a decimal number to binary; compute the greatest common divisor; transpose a matrix; read a CSV file and
sum a column; find the longest common prefix of several strings; implement bubble sort; implement quicksort;
implement merge sort; detect a cycle in a linked list; compute a running average of a stream; group words that
are anagrams; check balanced parentheses; convert Roman numerals to integers; format a number with thousands
separators; implement a least-recently-used cache; compute the edit distance between two strings; generate all
permutations of a list; find the most common element in a list; split a list into chunks of size n; implement
a binary tree with insert and search; do a breadth-first search on a graph; find the shortest path with
Dijkstra's algorithm; count the vowels in a string; capitalize the first letter of every word; compute the
factorial recursively; check if a number is prime; compute the median of a list; merge two dictionaries;
find the intersection of two lists; convert Celsius to Fahrenheit for a list of values; read a JSON file and print
a field; retry a function call with exponential backoff; measure how long a function takes; debounce a function;
implement a simple tokenizer for arithmetic expressions; evaluate a postfix expression; find the missing number in
1..n; compute the dot product of two vectors; implement a trie; count lines in a file; generate a random password;
compress a string with run-length encoding; compute the power set of a set; check whether two strings are
rotations of each other; find pairs in a list that sum to a target; implement a min-heap; schedule tasks by
priority; paginate a list of items; compute the day of the week for a date; validate a sudoku row""".replace("\n", " ")
CODE_TASKS = [t.strip() for t in CODE_TASKS.split(";") if t.strip()]
LANGUAGES = ["Python", "JavaScript", "TypeScript", "C", "C++", "Rust", "Go", "Java", "C#", "Ruby", "Kotlin", "Bash"]
CODE_TEMPLATES = [
    "Write a {lang} function to {task}.",
    "Write {lang} code to {task}, and explain how it works.",
    "How do I {task} in {lang}? Show a short example.",
    "What is the time complexity of the usual way to {task}? Show a {lang} implementation.",
    "Write a {lang} function to {task}, with a few test cases.",
    "Show two different ways to {task} in {lang} and compare them.",
]
STDLIB_TEMPLATES = [
    "Write a Python function `{signature}` that does the following: {summary}",
    "Explain what this Python function from the `{module}` module does:\n\n```python\n{source}\n```",
    "Write unit tests with pytest for `{module}.{name}`, which is documented as: {summary}",
    "How do I use `{module}.{name}` in Python? Give a short example.",
    "Implement the equivalent of Python's `{module}.{name}` in JavaScript. Its documentation says: {summary}",
    "Rewrite this function with type hints and a clearer structure:\n\n```python\n{source}\n```",
    "Review this code and point out possible problems or improvements:\n\n```python\n{source}\n```",
    "Write a docstring for this function:\n\n```python\n{source_nodoc}\n```",
]
CLI_TEMPLATES = [
    "How do I use the `{cmd}` command ({desc})? Give two examples.",
    "What does `{cmd}` do on Linux, and when would I use it?",
    "Write a shell script that uses `{cmd}` ({desc}) for a practical task.",
]
TEXT_TEMPLATES = [
    "Summarize the following text in {n} sentences:\n\n{x}",
    "Explain the following passage to a beginner:\n\n{x}",
    "List the key points of this text:\n\n{x}",
    "Write three questions a student might ask about this text, and answer them:\n\n{x}",
    "Rewrite this text in simpler words:\n\n{x}",
    "What is the main idea of the following text?\n\n{x}",
    "Give this text a title and a one-sentence summary:\n\n{x}",
    "{x}\n\nExplain the text above in your own words.",
    "{x}\n\nWhat are the most important terms in this text? Define each briefly.",
]

NAMES = ["Ava", "Ben", "Chen", "Dara", "Elif", "Farah", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo",
         "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tariq", "Uma", "Vik", "Wen", "Yara", "Zoe", "Liam",
         "Mia", "Noah", "Olga", "Pedro", "Sofia", "Tom", "Lucia", "Kenji", "Amara", "Diego"]  # fmt: skip
ITEMS = [("apple", "apples"), ("notebook", "notebooks"), ("pencil", "pencils"), ("sticker", "stickers"),
         ("cupcake", "cupcakes"), ("marble", "marbles"), ("book", "books"), ("toy car", "toy cars"),
         ("orange", "oranges"), ("candle", "candles"), ("ticket", "tickets"), ("seed packet", "seed packets"),
         ("muffin", "muffins"), ("shell", "shells"), ("balloon", "balloons"), ("card", "trading cards")]  # fmt: skip
MATH_KINDS = ["shop", "share", "speed", "work", "percent", "interest", "age", "area", "average", "fraction", "recipe",
              "savings", "ratio", "linear", "system", "quadratic", "series", "dice", "marbles", "choose", "gcd",
              "arith", "units", "clock", "derivative", "base", "wage", "discount"]  # fmt: skip
MATH_SUFFIXES = ["", " Show your reasoning step by step.", " Explain each step.", " Give the final answer at the end.",
                 " Think it through carefully."]  # fmt: skip
