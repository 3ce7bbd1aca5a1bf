package dist

import (
	"fmt"
	"strconv"
	"strings"
)

// maxHosts bounds ExpandNodelist: a malformed or hostile list such as
// n[0-999999999] is an error, not an allocation.
const maxHosts = 1 << 16

// A nodelist item (one host expression) is a sequence of parts: literal
// text, or a bracket's choices in order.
type hostExpr [][]string

// parseNodelist splits Slurm's compressed host list, e.g.
// "node[01-04,07],gpu5" or "r[1-2]n[3,5]", into host expressions. A range
// a-b keeps the width of a ("01-04": 01, 02, 03, 04).
func parseNodelist(list string) ([]hostExpr, error) {
	list = strings.TrimSpace(list)
	if list == "" {
		return nil, fmt.Errorf("empty node list")
	}
	var exprs []hostExpr
	var cur hostExpr
	lit := strings.Builder{}
	flush := func() {
		if lit.Len() > 0 {
			cur = append(cur, []string{lit.String()})
			lit.Reset()
		}
	}
	for i := 0; i < len(list); i++ {
		switch c := list[i]; c {
		case ',':
			flush()
			if len(cur) == 0 {
				return nil, fmt.Errorf("node list %q: empty host name at byte %d", list, i)
			}
			exprs, cur = append(exprs, cur), nil
		case '[':
			end := strings.IndexByte(list[i:], ']')
			if end < 0 {
				return nil, fmt.Errorf("node list %q: '[' at byte %d is not closed", list, i)
			}
			body := list[i+1 : i+end]
			if strings.ContainsAny(body, "[") {
				return nil, fmt.Errorf("node list %q: nested '[' at byte %d", list, i)
			}
			choices, err := expandRanges(body)
			if err != nil {
				return nil, fmt.Errorf("node list %q: [%s]: %v", list, body, err)
			}
			flush()
			cur = append(cur, choices)
			i += end
		case ']':
			return nil, fmt.Errorf("node list %q: ']' at byte %d closes nothing", list, i)
		case ' ', '\t', '\n':
			return nil, fmt.Errorf("node list %q: white space at byte %d", list, i)
		default:
			lit.WriteByte(c)
		}
	}
	flush()
	if len(cur) == 0 {
		return nil, fmt.Errorf("node list %q ends with an empty host name", list)
	}
	return append(exprs, cur), nil
}

// expandRanges expands a bracket's body, "01-04,07", in order.
func expandRanges(body string) ([]string, error) {
	var out []string
	for _, r := range strings.Split(body, ",") {
		lo, hi, isRange := strings.Cut(r, "-")
		a, err := strconv.ParseUint(lo, 10, 32)
		if err != nil || lo == "" {
			return nil, fmt.Errorf("%q is not a number or a range a-b", r)
		}
		if !isRange {
			out = append(out, lo)
			continue
		}
		b, err := strconv.ParseUint(hi, 10, 32)
		if err != nil || hi == "" {
			return nil, fmt.Errorf("%q is not a range a-b", r)
		}
		if b < a {
			return nil, fmt.Errorf("range %q runs backwards", r)
		}
		if b-a >= maxHosts || len(out)+int(b-a) >= maxHosts {
			return nil, fmt.Errorf("range %q holds more than %d hosts", r, maxHosts)
		}
		for n := a; n <= b; n++ {
			out = append(out, fmt.Sprintf("%0*d", len(lo), n))
		}
	}
	return out, nil
}

// FirstHost is the first host of a Slurm node list (SLURM_JOB_NODELIST,
// e.g. "node[01-04,07],gpu5" gives "node01"): where srun starts task 0 under
// its default distribution, hence rank 0's address.
func FirstHost(list string) (string, error) {
	exprs, err := parseNodelist(list)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for _, part := range exprs[0] {
		b.WriteString(part[0])
	}
	return b.String(), nil
}

// ExpandNodelist is every host of a Slurm node list, in Slurm's order
// ("r[1-2]n[3,5]": r1n3, r1n5, r2n3, r2n5); at most 65536.
func ExpandNodelist(list string) ([]string, error) {
	exprs, err := parseNodelist(list)
	if err != nil {
		return nil, err
	}
	var hosts []string
	for _, e := range exprs {
		names := []string{""}
		for _, part := range e {
			if len(names)*len(part)+len(hosts) > maxHosts {
				return nil, fmt.Errorf("node list %q holds more than %d hosts", list, maxHosts)
			}
			next := make([]string, 0, len(names)*len(part))
			for _, n := range names {
				for _, p := range part {
					next = append(next, n+p)
				}
			}
			names = next
		}
		hosts = append(hosts, names...)
	}
	return hosts, nil
}

// parseTasksPerNode expands SLURM_TASKS_PER_NODE's syntax, "2(x3),1": two
// tasks on each of three nodes, then one.
func parseTasksPerNode(v string) ([]int, error) {
	var out []int
	for _, item := range strings.Split(v, ",") {
		count, rep := item, "1"
		if i := strings.IndexByte(item, '('); i >= 0 {
			if !strings.HasPrefix(item[i:], "(x") || !strings.HasSuffix(item, ")") {
				return nil, fmt.Errorf("%q: want N or N(xM)", item)
			}
			count, rep = item[:i], item[i+2:len(item)-1]
		}
		n, err1 := strconv.Atoi(count)
		m, err2 := strconv.Atoi(rep)
		if err1 != nil || err2 != nil || n < 1 || m < 1 || len(out)+m > maxHosts {
			return nil, fmt.Errorf("%q: want N or N(xM) with positive N and M", item)
		}
		for range m {
			out = append(out, n)
		}
	}
	return out, nil
}
