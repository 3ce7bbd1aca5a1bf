package serve

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"distill/cache"
	pb "distill/proto/distill/v1"
)

var testLim = Limits{VocabSize: 100, MaxLen: 16, KDefault: 8, KMax: 50}

// FuzzValidateScore checks ValidateScore against a direct restatement of
// the rules: it accepts exactly the valid requests, rejects the others
// with InvalidArgument and a message naming the sample id, and never panics.
func FuzzValidateScore(f *testing.F) {
	f.Add(int64(1), []byte{1, 2, 3}, int32(0), false, float32(0))
	f.Add(int64(1), []byte{1, 2, 3}, int32(0), true, float32(0))
	f.Add(int64(2), []byte{}, int32(5), true, float32(1))
	f.Add(int64(3), []byte{200}, int32(51), true, float32(-1))
	f.Add(int64(4), make([]byte, 17), int32(-3), true, float32(math.Inf(1)))
	f.Add(int64(5), []byte{99, 0}, int32(50), true, float32(math.NaN()))
	f.Fuzz(func(t *testing.T, id int64, raw []byte, k int32, hasK bool, temp float32) {
		// Two bytes per token, signed, so ids range over [-32768, 32767].
		var toks []int32
		for i := 0; i+1 < len(raw); i += 2 {
			toks = append(toks, int32(int16(binary.LittleEndian.Uint16(raw[i:]))))
		}
		if len(raw) == 1 {
			toks = append(toks, int32(raw[0]))
		}
		req := &pb.ScoreRequest{Id: id, Tokens: toks, Temperature: temp}
		if hasK {
			req.K = &k
		}
		err := ValidateScore(req, testLim)
		valid := len(toks) > 0 && len(toks) <= testLim.MaxLen && (!hasK || (k >= 1 && k <= 50)) &&
			(temp == 0 || (temp > 0 && !math.IsInf(float64(temp), 1)))
		for _, x := range toks {
			valid = valid && x >= 0 && x < 100
		}
		if valid != (err == nil) {
			t.Fatalf("tokens %v k %d temp %v: valid=%v, err=%v", toks, k, temp, valid, err)
		}
		if err != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("code %v", status.Code(err))
			}
			if m := status.Convert(err).Message(); !strings.Contains(m, "sample id") {
				t.Fatalf("message does not name the sample: %q", m)
			}
		}
	})
}

// FuzzValidateFill does the same for Fill requests.
func FuzzValidateFill(f *testing.F) {
	f.Add("a.jsonl", 1.0, "", "", int64(0), int64(10), int64(0), int32(0), false, float32(0), "", `{"x":1}`)
	f.Add("a.jsonl", 1.0, "", "", int64(0), int64(10), int64(0), int32(0), true, float32(0), "", `{"x":1}`)
	f.Add("", 0.0, "csv", "drop", int64(5), int64(5), int64(-1), int32(-1), true, float32(-1), "zip", `[1]`)
	f.Add("b.parquet", math.NaN(), "xml", "keep", int64(-1), int64(3), int64(1<<20), int32(51), true, float32(2), "lossless", "")
	f.Fuzz(func(t *testing.T, path string, w float64, format, policy string, start, end, chunk int64, k int32, hasK bool, temp float32, enc, vars string) {
		r := &pb.FillRequest{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: path, Weight: w, Format: format}}, Policy: policy, TemplateVarsJson: vars},
			Start: start, End: end, ChunkSamples: chunk, Temperature: temp, Encoding: enc}
		if hasK {
			r.K = &k
		}
		err := ValidateFill(r, testLim)
		valid := path != "" && w >= 0 && !math.IsInf(w, 0) && !math.IsNaN(w) &&
			(format == "" || format == "jsonl" || format == "csv" || format == "parquet") &&
			(policy == "" || policy == "truncate" || policy == "drop") &&
			start >= 0 && end > start && chunk >= 0 && chunk <= cache.MaxChunkSamples &&
			(!hasK || (k >= 1 && k <= 50)) && (temp == 0 || (temp > 0 && !math.IsInf(float64(temp), 1))) &&
			(enc == "" || enc == "compact" || enc == "lossless") && (vars == "" || validJSONMap(vars))
		if valid != (err == nil) {
			t.Fatalf("%v: valid=%v, err=%v", r, valid, err)
		}
		if err != nil && status.Code(err) != codes.InvalidArgument {
			t.Fatalf("code %v", status.Code(err))
		}
	})
}

func validJSONMap(s string) bool {
	var m map[string]any
	return json.Unmarshal([]byte(s), &m) == nil
}
