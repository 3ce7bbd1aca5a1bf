package cache

import (
	"bufio"
	"bytes"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
)

var arrowJSModules = filepath.Join("..", "testdata-fetched", "npm-arrow", "node_modules")

// TestChunkReadableByArrowJS reads chunk files with Apache Arrow's
// JavaScript implementation (installed by scripts/setup.d/cache.sh) and
// decodes them with the package doc's formulas, written independently in
// testdata/arrowjs_decode.js: the result must equal what this package
// decodes, bit for bit. This backs the claim that chunks are plain Arrow
// with documented decode formulas (what pyarrow users rely on).
func TestChunkReadableByArrowJS(t *testing.T) {
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatal("node is not installed: run scripts/setup-test.sh")
	}
	if _, err := os.Stat(filepath.Join(arrowJSModules, "apache-arrow", "package.json")); err != nil {
		t.Fatalf("apache-arrow (npm) is missing: run scripts/setup-test.sh (%v)", err)
	}
	mods, _ := filepath.Abs(arrowJSModules)
	for _, enc := range []Encoding{EncodingCompact, EncodingLossless} {
		dir := t.TempDir()
		c, err := Create(dir, testManifest(12, enc), nil)
		if err != nil {
			t.Fatal(err)
		}
		fillRange(t, c, 0, 12)
		c.Close()
		r, err := OpenReader(dir)
		if err != nil {
			t.Fatal(err)
		}
		var out, stderr bytes.Buffer
		cmd := exec.Command(node, filepath.Join("testdata", "arrowjs_decode.js"), mods, r.Chunks()[0].Path())
		cmd.Stdout, cmd.Stderr = &out, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("%s: node: %v\n%s", enc, err, stderr.String())
		}
		sc := bufio.NewScanner(&out)
		sc.Buffer(nil, 1<<24)
		sc.Scan()
		var md map[string]string
		if err := json.Unmarshal(sc.Bytes(), &md); err != nil {
			t.Fatal(err)
		}
		if md[metaEncoding] != string(enc) || md[metaK] != strconv.Itoa(tK) || md[metaStart] != "0" || md[metaEnd] != "12" {
			t.Fatalf("%s: metadata seen by arrow-js: %v", enc, md)
		}
		n := int64(0)
		for ; sc.Scan(); n++ {
			var rec struct {
				Index    int64    `json:"index"`
				InputIDs []int32  `json:"input_ids"`
				LossMask []uint8  `json:"loss_mask"`
				TopKIDs  []int32  `json:"topk_ids"`
				LPBits   []uint32 `json:"lp_bits"`
			}
			if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
				t.Fatal(err)
			}
			want, err := r.Get(n)
			if err != nil {
				t.Fatal(err)
			}
			if rec.Index != n || len(rec.InputIDs) != len(want.Tokens) || len(rec.TopKIDs) != len(want.TopKIDs) || len(rec.LPBits) != len(want.TopKLogProbs) {
				t.Fatalf("%s: row %d: arrow-js sees index %d with %d tokens, %d ids, %d log-probs", enc, n, rec.Index, len(rec.InputIDs), len(rec.TopKIDs), len(rec.LPBits))
			}
			for p := range want.Tokens {
				if rec.InputIDs[p] != want.Tokens[p] || rec.LossMask[p] != want.Mask[p] {
					t.Fatalf("%s: sample %d position %d: tokens differ", enc, n, p)
				}
			}
			for e := range want.TopKIDs {
				if rec.TopKIDs[e] != want.TopKIDs[e] || math.Float32frombits(rec.LPBits[e]) != want.TopKLogProbs[e] {
					t.Fatalf("%s: sample %d entry %d: arrow-js (%d, %v), Go (%d, %v)", enc, n, e, rec.TopKIDs[e], math.Float32frombits(rec.LPBits[e]), want.TopKIDs[e], want.TopKLogProbs[e])
				}
			}
		}
		if n != 12 {
			t.Fatalf("%s: arrow-js read %d rows, want 12", enc, n)
		}
	}
}

// TestSampledChunkReadableByArrowJS is TestChunkReadableByArrowJS for the
// sampled kinds (format version 2): Apache Arrow's JavaScript reader and
// the package doc's formulas give the draws, counts, tail masses and head
// this package decodes, bit for bit.
func TestSampledChunkReadableByArrowJS(t *testing.T) {
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatal("node is not installed: run scripts/setup-test.sh")
	}
	mods, _ := filepath.Abs(arrowJSModules)
	for _, kind := range []Targets{TargetsSampled, TargetsHeadSampled} {
		for _, enc := range []Encoding{EncodingCompact, EncodingLossless} {
			dir := t.TempDir()
			m := sampledManifest(9, enc, kind, 50)
			c, err := Create(dir, m, nil)
			if err != nil {
				t.Fatal(err)
			}
			fillSampled(t, c, &m, 0, 9)
			c.Close()
			r, err := OpenReader(dir)
			if err != nil {
				t.Fatal(err)
			}
			var out, stderr bytes.Buffer
			cmd := exec.Command(node, filepath.Join("testdata", "arrowjs_decode.js"), mods, r.Chunks()[0].Path())
			cmd.Stdout, cmd.Stderr = &out, &stderr
			if err := cmd.Run(); err != nil {
				t.Fatalf("%s %s: node: %v\n%s", kind, enc, err, stderr.String())
			}
			sc := bufio.NewScanner(&out)
			sc.Buffer(nil, 1<<24)
			sc.Scan()
			var md map[string]string
			if err := json.Unmarshal(sc.Bytes(), &md); err != nil {
				t.Fatal(err)
			}
			if md[metaTargets] != string(kind) || md[metaDraws] != "50" || md[metaVersion] != "2" {
				t.Fatalf("%s %s: metadata seen by arrow-js: %v", kind, enc, md)
			}
			n := int64(0)
			for ; sc.Scan(); n++ {
				var rec struct {
					TopKIDs    []int32  `json:"topk_ids"`
					LPBits     []uint32 `json:"lp_bits"`
					DrawN      []int32  `json:"draw_n"`
					DrawIDs    []int32  `json:"draw_ids"`
					DrawCounts []int32  `json:"draw_counts"`
					TailBits   []uint32 `json:"tail_bits"`
				}
				if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
					t.Fatal(err)
				}
				want, err := r.Get(n)
				if err != nil {
					t.Fatal(err)
				}
				got := Sample{Index: n, DrawN: rec.DrawN, DrawIDs: rec.DrawIDs, DrawCounts: rec.DrawCounts}
				for _, b := range rec.TailBits {
					got.TailMass = append(got.TailMass, math.Float32frombits(b))
				}
				sameDraws(t, got, want)
				if len(rec.TopKIDs) != len(want.TopKIDs) || len(rec.LPBits) != len(want.TopKLogProbs) {
					t.Fatalf("%s %s: sample %d: arrow-js sees %d head ids, %d log-probs; Go %d", kind, enc, n, len(rec.TopKIDs), len(rec.LPBits), len(want.TopKIDs))
				}
				for e := range want.TopKIDs {
					if rec.TopKIDs[e] != want.TopKIDs[e] || math.Float32frombits(rec.LPBits[e]) != want.TopKLogProbs[e] {
						t.Fatalf("%s %s: sample %d head %d differs", kind, enc, n, e)
					}
				}
			}
			if n != 9 {
				t.Fatalf("%s %s: arrow-js read %d rows, want 9", kind, enc, n)
			}
		}
	}
}
