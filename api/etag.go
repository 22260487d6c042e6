package api

// Conditional requests on the reference store (RFC 9110 §13): a document's
// entity tag is its version, quoted ("3"), a strong validator (the version
// changes with every accepted write). PUT honours If-Match and
// If-None-Match (412 precondition-failed when the document is in another
// state, and nothing is written); GET honours If-Match (412) and
// If-None-Match (304).

import (
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/redfence/redfence/internal/refstore"
)

// etag is the entity tag of a document at version.
func etag(version int64) string { return `"` + strconv.FormatInt(version, 10) + `"` }

// entityTags is a parsed If-Match or If-None-Match field.
type entityTags struct {
	present bool
	any     bool // "*"
	// strong and weak are the versions named by strong tags (“"3"”) and
	// by weak ones (“W/"3"”); tags whose opaque value is not a version
	// name none (they match no document).
	strong, weak []int64
}

// parseEntityTags parses the field name of h: "*" or a comma-separated list
// of entity tags (RFC 9110 §8.8.3, §13.1.1). It returns a requestError
// naming the field when the value is malformed.
func parseEntityTags(h http.Header, name string) (entityTags, error) {
	values := h.Values(name)
	if len(values) == 0 {
		return entityTags{}, nil
	}
	et := entityTags{present: true}
	value := strings.Join(values, ",")
	// OWS is spaces and tabs only (RFC 9110 §5.6.3): a Unicode space
	// around "*" (strings.TrimSpace's) makes the field malformed.
	if strings.Trim(value, " \t") == "*" {
		et.any = true
		return et, nil
	}
	bad := func(why string) (entityTags, error) {
		return entityTags{}, invalid(name+" "+why, InvalidParam{Name: name, Reason: why})
	}
	rest := value
	tags := 0
	for {
		rest = strings.TrimLeft(rest, " \t")
		if rest == "" {
			break
		}
		if rest[0] == ',' { // empty list elements are allowed (RFC 9110 §5.6.1)
			rest = rest[1:]
			continue
		}
		weak := strings.HasPrefix(rest, "W/")
		if weak {
			rest = rest[2:]
		}
		if rest == "" || rest[0] != '"' {
			return bad(`must be * or a list of entity tags, each quoted ("3", or W/"3")`)
		}
		end := 1
		for end < len(rest) && rest[end] != '"' {
			if c := rest[end]; c < 0x21 || c == 0x7f {
				return bad("must not hold control characters or spaces inside an entity tag")
			}
			end++
		}
		if end == len(rest) {
			return bad("has an entity tag without its closing quote")
		}
		opaque := rest[1:end]
		rest = strings.TrimLeft(rest[end+1:], " \t")
		if rest != "" && rest[0] != ',' {
			return bad("must separate its entity tags with commas")
		}
		tags++
		if v, err := strconv.ParseInt(opaque, 10, 64); err == nil && v > 0 && strconv.FormatInt(v, 10) == opaque {
			if weak {
				et.weak = append(et.weak, v)
			} else {
				et.strong = append(et.strong, v)
			}
		}
	}
	if tags == 0 {
		return bad(`must be * or a list of entity tags, each quoted ("3", or W/"3")`)
	}
	return et, nil
}

// putCondition reads a PUT's If-Match and If-None-Match as a store
// condition. If-Match compares strongly (a weak tag never matches),
// If-None-Match weakly.
func putCondition(r *http.Request) (refstore.Condition, error) {
	var c refstore.Condition
	m, err := parseEntityTags(r.Header, "If-Match")
	if err != nil {
		return c, err
	}
	n, err := parseEntityTags(r.Header, "If-None-Match")
	if err != nil {
		return c, err
	}
	if m.present {
		c.Exists = true
		if !m.any {
			c.Versions = append([]int64{}, m.strong...)
		}
	}
	if n.present {
		if n.any {
			c.Absent = true
		} else {
			c.NotVersions = append(append([]int64{}, n.strong...), n.weak...)
		}
	}
	return c, nil
}

// match reports whether an If-Match matches a document at version (strong
// comparison: a weak tag never matches).
func (et entityTags) match(version int64) bool {
	return et.any || slices.Contains(et.strong, version)
}

// noneMatch reports whether a GET's If-None-Match matches a document at
// version (weak comparison): the answer is then 304 Not Modified.
func (et entityTags) noneMatch(version int64) bool {
	return et.any || slices.Contains(et.strong, version) || slices.Contains(et.weak, version)
}
