// Command gendata writes the quick start's chat datasets: sentences of a
// small stochastic formal language, a toy English whose grammar and word
// probabilities are fixed tables in this file.
//
//	go run ./examples/quickstart/gendata -out out/quickstart/data
//
// The user asks for a sentence about a noun ("Write a sentence about the
// cats."); the assistant answers with one sentence of the language: a
// subject built on that noun (copied, singular or plural), a verb that
// agrees with it in number and suits it (animals do not read), an object
// that suits the verb (one eats a pear, reads a letter), optional
// adjectives that suit their nouns, and an optional place:
//
//	Two happy cats chase a small mouse near the river.
//
// Every word is one Qwen3 token, so every answer token is one draw from
// a known distribution: the language's entropy per token is the lowest
// held-out CE any model can reach, and gendata reports it for the
// held-out split (-stats). Some tokens are certain given the question and
// the words so far (the subject's noun, the verb's number, the final
// period); most are not, and there the right prediction is a
// distribution, which a teacher's top-k carries and a label does not.
//
// It writes two JSONL files of {"messages": [user, assistant]} records:
//
//   - teacher.jsonl: what the teacher is trained on;
//   - distill.jsonl: the transfer set. Its first -heldout records are the
//     held-out split (data.eval_range [0, heldout]), whose answers appear
//     nowhere else, in either file; the rest are what the two students
//     train on (KD from the cache filled over this file, or SFT on it).
//
// The output depends only on the flags.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
)

func main() {
	out := flag.String("out", "", "output directory (required)")
	nTeacher := flag.Int("teacher", 10000, "records in teacher.jsonl")
	nDistill := flag.Int("distill", 2000, "records in distill.jsonl, the held-out split included")
	nHeld := flag.Int("heldout", 200, "the first records of distill.jsonl held out (answers found nowhere else)")
	seed := flag.Uint64("seed", 1, "sampling seed (the language itself is fixed)")
	stats := flag.Bool("stats", true, "print the held-out split's entropy per answer token (the CE floor)")
	flag.Parse()
	st, err := run(*out, *nTeacher, *nDistill, *nHeld, *seed)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gendata:", err)
		os.Exit(1)
	}
	if *stats {
		fmt.Printf("gendata: %d teacher and %d transfer records (the first %d held out) in %s; held-out entropy %.4f nats per answer token (%d tokens)\n",
			*nTeacher, *nDistill, *nHeld, *out, st.HeldoutEntropy, st.HeldoutTokens)
	}
}

// Stats describes the held-out split.
type Stats struct {
	// HeldoutEntropy is the mean of -log p over the held-out answers'
	// tokens (the words, the period and the end-of-turn token, which is
	// certain), under the language's own probabilities: the CE of a
	// perfect model, which no model beats on average.
	HeldoutEntropy float64 `json:"heldout_entropy"`
	HeldoutTokens  int     `json:"heldout_tokens"`
}

func run(out string, nTeacher, nDistill, nHeld int, seed uint64) (Stats, error) {
	if out == "" {
		return Stats{}, fmt.Errorf("-out DIR is required")
	}
	if nTeacher < 1 || nDistill < 1 || nHeld < 1 || nHeld >= nDistill {
		return Stats{}, fmt.Errorf("want -teacher >= 1, -distill >= 1 and 1 <= -heldout < -distill (got %d, %d, %d)", nTeacher, nDistill, nHeld)
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return Stats{}, err
	}
	r := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	held := map[string]bool{}
	var distill, teacher []record
	var st Stats
	var nll float64
	for len(distill) < nDistill {
		s := sentence(r)
		if len(distill) < nHeld {
			if held[s.key()] {
				continue
			}
			held[s.key()] = true
			nll += s.nll
			st.HeldoutTokens += len(s.words) + 2 // + "." + end of turn
		} else if held[s.key()] {
			continue
		}
		distill = append(distill, s.chat())
	}
	for len(teacher) < nTeacher {
		s := sentence(r)
		if held[s.key()] {
			continue
		}
		teacher = append(teacher, s.chat())
	}
	st.HeldoutEntropy = nll / float64(st.HeldoutTokens)
	if err := write(filepath.Join(out, "distill.jsonl"), distill); err != nil {
		return Stats{}, err
	}
	if err := write(filepath.Join(out, "teacher.jsonl"), teacher); err != nil {
		return Stats{}, err
	}
	b, _ := json.MarshalIndent(st, "", "  ")
	return st, os.WriteFile(filepath.Join(out, "stats.json"), append(b, '\n'), 0o644)
}

// choice is a weighted set of words.
type choice struct {
	words   []string
	weights []float64
}

func ch(ws ...any) choice {
	var c choice
	for i := 0; i < len(ws); i += 2 {
		c.words = append(c.words, ws[i].(string))
		c.weights = append(c.weights, float64(ws[i+1].(int)))
	}
	return c
}

// draw picks a word and returns it with its log-probability.
func (c choice) draw(r *rand.Rand) (string, float64) {
	total := 0.0
	for _, w := range c.weights {
		total += w
	}
	x := r.Float64() * total
	for i, w := range c.weights {
		if x < w || i == len(c.weights)-1 {
			return c.words[i], math.Log(w / total)
		}
		x -= w
	}
	panic("unreachable")
}

// coin is true with probability p; it returns the log-probability of
// the outcome too.
func coin(r *rand.Rand, p float64) (bool, float64) {
	if r.Float64() < p {
		return true, math.Log(p)
	}
	return false, math.Log(1 - p)
}

type subject struct {
	sg, pl, class string
}

// The language. Subjects are animals or people; a verb's object classes
// and a class's words and adjectives are weighted choices.
var (
	subjects = []subject{
		{"cat", "cats", "animal"}, {"dog", "dogs", "animal"}, {"bird", "birds", "animal"}, {"horse", "horses", "animal"},
		{"girl", "girls", "person"}, {"boy", "boys", "person"}, {"farmer", "farmers", "person"}, {"king", "kings", "person"},
		{"teacher", "teachers", "person"}, {"child", "children", "person"},
	}
	detSg = ch("The", 6, "A", 3, "My", 1)
	detPl = ch("The", 5, "Some", 3, "Two", 2)
	// P(adjective before the subject) and which, by class.
	subjAdjP = 0.3
	subjAdj  = map[string]choice{
		"animal": ch("small", 4, "big", 3, "black", 2, "happy", 2, "little", 1),
		"person": ch("young", 4, "tall", 3, "happy", 2, "wise", 2, "kind", 1),
	}
	// verb (singular form) -> plural form
	plural = map[string]string{"eats": "eat", "reads": "read", "catches": "catch", "sees": "see", "likes": "like",
		"finds": "find", "wants": "want", "holds": "hold", "draws": "draw", "loses": "lose"}
	verbs = map[string]choice{
		"animal": ch("eats", 5, "catches", 4, "sees", 3, "likes", 2, "finds", 2, "wants", 2, "loses", 1),
		"person": ch("eats", 2, "reads", 3, "sees", 2, "likes", 3, "finds", 2, "wants", 2, "holds", 3, "draws", 2, "catches", 1, "loses", 1),
	}
	// verb -> class of its object
	objClass = map[string]choice{
		"eats":    ch("food", 1),
		"reads":   ch("text", 1),
		"catches": ch("animal", 3, "toy", 1),
		"sees":    ch("animal", 2, "thing", 2, "food", 1, "toy", 1),
		"likes":   ch("food", 2, "toy", 2, "animal", 2, "text", 1),
		"finds":   ch("thing", 3, "toy", 2, "text", 1),
		"wants":   ch("food", 3, "toy", 2, "thing", 1),
		"holds":   ch("thing", 2, "toy", 2, "text", 1, "food", 1),
		"draws":   ch("animal", 3, "thing", 1),
		"loses":   ch("thing", 3, "toy", 1),
	}
	objDet   = ch("the", 5, "a", 4, "her", 1, "his", 1)
	objAdjP  = 0.4
	objNouns = map[string]choice{
		"food":   ch("pear", 4, "cake", 3, "plum", 2, "pie", 2, "bun", 1),
		"text":   ch("book", 4, "letter", 3, "map", 2, "poem", 1),
		"animal": ch("mouse", 4, "bird", 3, "cat", 2, "dog", 2, "frog", 1),
		"toy":    ch("ball", 4, "kite", 3, "doll", 2, "drum", 1),
		"thing":  ch("key", 4, "hat", 3, "cup", 2, "box", 2, "coin", 1),
	}
	objAdj = map[string]choice{
		"food":   ch("sweet", 4, "warm", 3, "fresh", 2, "big", 1),
		"text":   ch("long", 4, "thick", 3, "short", 2, "new", 1),
		"animal": ch("small", 4, "grey", 3, "fat", 2, "lazy", 1),
		"toy":    ch("red", 4, "blue", 3, "new", 2, "loud", 1),
		"thing":  ch("small", 4, "green", 3, "rusty", 2, "shiny", 1),
	}
	placeP = 0.35
	preps  = ch("in", 4, "near", 3, "under", 2, "behind", 1)
	places = ch("garden", 4, "house", 3, "tree", 2, "river", 2, "barn", 1)
)

// sent is one sentence: the subject noun of the question, the answer's
// words (without the period) and their total -log p.
type sent struct {
	noun  string
	words []string
	nll   float64
}

func (s sent) key() string { return s.noun + "|" + strings.Join(s.words, " ") }

func (s sent) chat() record {
	return record{Messages: []message{
		{Role: "user", Content: "Write a sentence about the " + s.noun + "."},
		{Role: "assistant", Content: strings.Join(s.words, " ") + "."},
	}}
}

// sentence draws a question and its answer. The question's noun and
// number are uniform and not part of the answer's entropy (the user
// turn is not a target).
func sentence(r *rand.Rand) sent {
	sub := subjects[r.IntN(len(subjects))]
	pl := r.IntN(2) == 1
	var s sent
	add := func(w string, lp float64) {
		s.words = append(s.words, w)
		s.nll -= lp
	}
	s.noun = sub.sg
	det := detSg
	if pl {
		s.noun, det = sub.pl, detPl
	}
	add(det.draw(r))
	if ok, lp := coin(r, subjAdjP); ok {
		s.nll -= lp
		add(subjAdj[sub.class].draw(r))
	} else {
		s.nll -= lp
	}
	add(s.noun, 0) // the question's noun: certain
	v, lp := verbs[sub.class].draw(r)
	if pl {
		add(plural[v], lp)
	} else {
		add(v, lp)
	}
	class, lp := objClass[v].draw(r)
	s.nll -= lp
	add(objDet.draw(r))
	if ok, lp := coin(r, objAdjP); ok {
		s.nll -= lp
		add(objAdj[class].draw(r))
	} else {
		s.nll -= lp
	}
	add(objNouns[class].draw(r))
	if ok, lp := coin(r, placeP); ok {
		s.nll -= lp
		add(preps.draw(r))
		add("the", 0)
		add(places.draw(r))
	} else {
		s.nll -= lp
	}
	return s
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type record struct {
	Messages []message `json:"messages"`
}

func write(path string, recs []record) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	enc := json.NewEncoder(w)
	for _, rec := range recs {
		if err := enc.Encode(rec); err != nil {
			f.Close()
			return err
		}
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
